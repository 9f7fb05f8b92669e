"""The in-server agent: sampling inside a server process kvmem starts but does not edit.

This folder goes first on the server's `PYTHONPATH` (for that child alone), so its
`sitecustomize` runs when the server's interpreter starts; `kvmem_agent` does the work. Both
import nothing from kvmem: the server may run in another environment than kvmem's. The
protocol is in docs/serve.md.
"""
