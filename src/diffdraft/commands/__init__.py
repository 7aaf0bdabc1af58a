"""What the commands share over the generator: the options that choose what to load (``model_options``)."""
