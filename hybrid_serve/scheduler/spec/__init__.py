"""Speculative decoding with the checkpoint's MTP head (`worker.py`), behind one seam: the
scheduler's forward step, wrapped. Imports nothing, so that `scheduler/request.py` can take
`state.py` alone."""
