"""`python -m experiments.benchmark`: see the package's docstring and `cli`."""

from absl import app

from experiments.benchmark import cli

if __name__ == "__main__":
    cli.define_flags()
    app.run(cli.main)
