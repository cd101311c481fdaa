"""The dense encoder: same vectors as sentence-transformers, prefixes, and the encoder fingerprint."""

import numpy as np
import pytest

from retrieval.encoder import E5_PREFIXES, Encoder, default_prefixes, fingerprint, read_st_config


@pytest.fixture(scope="module")
def enc(minilm):
    return Encoder(minilm)


def test_minilm_matches_sentence_transformers(enc, minilm):
    from sentence_transformers import SentenceTransformer

    texts = ["who wrote hamlet", "Paris\nParis is the capital and largest city of France. " * 4, "x"]
    ours = enc.encode(texts, is_query=False, batch_size=2)  # batch of 2 + 1: padding must not matter
    ref = SentenceTransformer(minilm, device="cpu").encode(texts, convert_to_numpy=True)
    assert ours.shape == (3, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # normalised -> inner product = cosine


def test_settings_read_from_sentence_transformers_folder(enc, minilm):
    assert read_st_config(minilm) == {"normalize": True, "pooling": "mean", "max_length": 256}
    assert enc.settings() == {"pooling": "mean", "normalize": True, "query_prefix": "", "passage_prefix": "",
                              "max_length": 256}
    assert enc.dim == 384


def test_prefixes_are_applied(minilm):
    e = Encoder(minilm, query_prefix="query: ", passage_prefix="passage: ")
    plain = Encoder(minilm)
    np.testing.assert_allclose(e.encode(["abc"], is_query=True), plain.encode(["query: abc"], is_query=True), atol=1e-6)
    np.testing.assert_allclose(e.encode(["abc"], is_query=False), plain.encode(["passage: abc"], is_query=False), atol=1e-6)
    assert not np.allclose(e.encode(["abc"], is_query=True), e.encode(["abc"], is_query=False))


def test_e5_prefixes_by_name(tmp_path):
    for name in ("e5-base-v2", "multilingual-e5-large"):
        (tmp_path / name).mkdir()
        assert default_prefixes(tmp_path / name) == E5_PREFIXES
    (tmp_path / "e5-small" / "model").mkdir(parents=True)  # generic folder name: the parent names the model
    assert default_prefixes(tmp_path / "e5-small" / "model") == E5_PREFIXES
    (tmp_path / "all-MiniLM-L6-v2").mkdir()
    assert default_prefixes(tmp_path / "all-MiniLM-L6-v2") == ("", "")


def test_fingerprint_follows_the_model_not_the_path(minilm, minilm_elsewhere, other_encoder, tmp_path):
    assert fingerprint(minilm) == fingerprint(minilm_elsewhere)
    assert fingerprint(minilm) != fingerprint(other_encoder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fingerprint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither config.json nor weight"):
        fingerprint(tmp_path)


def test_empty_input(enc):
    assert enc.encode([], is_query=True).shape == (0, 384)


def _st_copy(minilm, tmp_path, pooling: dict | None = None, extra_module: str | None = None):
    """MiniLM's folder with its pooling config or module list changed (the weights linked, not copied)."""
    import json
    from pathlib import Path

    out = tmp_path / "st"
    out.mkdir()
    for f in Path(minilm).iterdir():
        if f.name not in ("1_Pooling", "modules.json"):
            (out / f.name).symlink_to(f)
    (out / "1_Pooling").mkdir()
    pc = json.loads((Path(minilm) / "1_Pooling" / "config.json").read_text())
    pc.update(pooling or {})
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pc))
    mods = json.loads((Path(minilm) / "modules.json").read_text())
    if extra_module:
        mods.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": extra_module})
    (out / "modules.json").write_text(json.dumps(mods))
    return out


@pytest.mark.parametrize("pooling, needle", [
    ({"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}, "pooling_mode_lasttoken"),
    ({"pooling_mode_mean_tokens": False, "pooling_mode_weightedmean_tokens": True}, "pooling_mode_weightedmean_tokens"),
    ({"pooling_mode_cls_token": True}, "pooling_mode_cls_token"),      # two modes at once: concatenated vectors
    ({"pooling_mode_mean_tokens": False}, "pooling none"),
])
def test_pooling_it_does_not_implement_is_refused_by_name(minilm, tmp_path, pooling, needle):
    """Before, max pooling (and every other mode) silently became mean pooling: other vectors, no error."""
    folder = _st_copy(minilm, tmp_path, pooling)
    with pytest.raises(ValueError, match=needle):
        Encoder(folder)


def test_a_dense_module_is_refused_and_cls_is_read(minilm, tmp_path):
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense"):
        read_st_config(_st_copy(minilm, tmp_path, extra_module="sentence_transformers.models.Dense"))
    cls = tmp_path / "cls"
    cls.mkdir()
    assert read_st_config(_st_copy(minilm, cls, {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))[
        "pooling"] == "cls"
