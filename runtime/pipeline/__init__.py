"""The pipeline runtime: boundary transfers (transfer), the per-rank stage set-up and the
action-list executor (trainer). Our own executor over torch.distributed point-to-point, not
torch.distributed.pipelining: that allows one rank per stage with 1:1 send/recv pairs, equal
micro-batch shapes, and its gloo path has hung here before."""
