"""One module or folder per engine: what it plans (pure) and how its plans run."""
