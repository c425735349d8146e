"""Settings: the typed configuration (file, flags, environment), the web-config file, one-line errors."""
