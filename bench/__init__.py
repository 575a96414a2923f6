"""The serving benchmark (`python -m bench`): one module per section, the CLI in `__main__.py`.

`streams` and `runners` are the shared fixtures (reading a stream as a measurement; runners whose
store holds random K/V); `layers` measures one stream through each layer of the service; the
sections are `mixed`, `throughput`, `steps`, `share`, `policies` and `fused`. It may import any
package of the project: it measures the service against export's and models' own loops.
"""
