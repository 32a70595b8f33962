"""The Accelerate config file: typed model, load/save, migrations, defaults, questionnaire."""
