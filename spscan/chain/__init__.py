"""The chain front end: an ``nn.Sequential`` of supported layers as one scan (its plan, :mod:`.model`; the
wrapper's step backward with its parameter gradients, :mod:`.backward`)."""
