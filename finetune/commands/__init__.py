"""Layer `commands`: one module per verb. Each parses its arguments (`register` adds its subparser and
sets `run`), calls the layers below and prints; nothing else. Importing a command module is cheap: heavy
libraries are imported inside `run`, so `--help` and bad input answer at once."""
