"""The recurrent front end: ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` as scans over time. One wrapper
(:mod:`.wrapper`) over the single-layer plan (:mod:`.plan`, with its forward and backward in :mod:`.forward`
and :mod:`.backward`) or the stacked and bidirectional one (:mod:`.stacked`); each cell (:mod:`.cells`) and
its chain's elements (:mod:`.elements`); the Newton forward (:mod:`.newton`)."""
