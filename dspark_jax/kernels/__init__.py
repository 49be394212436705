"""Ragged paged attention kernels: one entry point chosen by backend (`ragged_paged_attention`), the einsum
reference, the XLA path for CPU, a thin wrapper over the TPU kernel jax ships, a Pallas (Triton) kernel for GPU,
and the page-pool writes (`write_kv`, `slot_mapping`)."""

from dspark_jax.kernels.attention import (
    check_inputs,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
    slot_mapping,
    write_kv,
)
from dspark_jax.kernels.gpu import ragged_paged_attention_gpu
from dspark_jax.kernels.tpu import ragged_paged_attention_tpu

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "ragged_paged_attention_xla",
           "ragged_paged_attention_tpu", "ragged_paged_attention_gpu", "write_kv", "slot_mapping", "check_inputs"]
