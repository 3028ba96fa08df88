"""The fine-tuning script's usage error, shared by the modules that check its inputs."""


class FineTuningError(ValueError):
    """Bad input the user can fix (a data file, an argument value); the message names it and says what to do."""
