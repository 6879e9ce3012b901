"""The model-parallel scan's plan (:mod:`.plan`; its run is the public :mod:`spscan.distributed`) and the
pipeline-schedule study it is compared with (:mod:`.pipeline`)."""
