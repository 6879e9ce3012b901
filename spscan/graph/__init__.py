"""The traced-graph front end: any model ``torch.fx`` traces, its nodes matched to layer units
(:mod:`.trace`, after the rewrites of :mod:`.rewrites` and :mod:`.recurrent`), planned as a chain of
series-parallel blocks or of live-set steps (:mod:`.segments`, :mod:`.plan`)."""
