"""The flags and their checks: the settings groups declared once, Config, validate_args, preflight."""
