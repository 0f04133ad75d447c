"""Remote: the embedding stage as a client of an inference server (the Open Inference
Protocol, KServe v2): the protocol's encoding, the HTTP client with its retries, what to
send a served model, and a served model's run in the embedding job, which keeps a bounded
number of requests in flight.

Imports `embed` (settings, store, progress), `loader`, `models` (the registry and the
preprocessing it shares with the local backend), `tiling`, `errors` and `atomic`; never
`torch.cuda`: a remote job holds no GPU.
"""
