"""Running on a cluster: what the scheduler does with the workflow's jobs. Imports only
`errors`; never torch, since the workflow's main process imports it."""
