"""`kvmem record`: a command kvmem did not configure, started with its agent injected and
sampled with its Python children until it ends (`recording.py`, following its processes in
`followed.py`), judged and reported as `kvmem run` reports a variant (harness.pipeline.judged)."""
