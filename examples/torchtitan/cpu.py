"""torchtitan 0.3.0 on a machine without a GPU and with a released torch (2.13), as in snapshotd's tests.

torchtitan targets CUDA and a torch nightly. :func:`apply` patches the four places where that shows, before the
Trainer is imported, and changes nothing else:

- the device: torchtitan falls back to ``"cuda"`` when it finds no accelerator; here it is ``"cpu"`` (gloo), with a
  device module answering the calls torchtitan makes of ``torch.cuda`` (memory statistics report nothing);
- attention: the language models' attention backends are FlexAttention (no backward pass on CPU) and varlen
  (flash attention, CUDA only); here the attention kernel is causal ``scaled_dot_product_attention`` (the documents
  of a packed sequence then see each other: the same model otherwise), and the block mask FlexAttention would
  read is built eagerly (compiled, as torchtitan builds it, it costs seconds of inductor on CPU at the first step);
- gradient reduction: torchtitan turns FSDP's gradient division off, which makes FSDP reduce with ``PREMUL_SUM(1)``,
  an op gloo lacks; here FSDP sums (the same result);
- ``torch.distributed.set_timeout`` (a nightly API) is ``_set_pg_timeout`` of torch 2.13.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

__all__ = ["apply"]


class _Properties:
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


_CPU = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: 0,
    set_device=_noop,
    synchronize=_noop,
    empty_cache=_noop,
    reset_peak_memory_stats=_noop,
    get_device_name=lambda *a: "cpu",
    get_device_properties=lambda *a: _Properties(),
    memory_stats=lambda *a: {},
)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Any, enable_gqa: bool, **_: Any
) -> tuple[torch.Tensor, None]:
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )
    return out, None


def apply() -> None:
    """Patch torchtitan for this machine; call it before importing ``torchtitan.trainer``."""
    import torch.distributed as dist
    import torchtitan.tools.utils as utils
    from torch.distributed.distributed_c10d import _set_pg_timeout

    utils.device_type, utils.device_module = "cpu", _CPU

    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.models.common.decoder as decoder
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import FlexAttention

    def summing_fsdp(model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = summing_fsdp
    FlexAttention.compiled_flex_attn = staticmethod(_causal_attention)
    decoder.create_attention_mask = create_block_mask
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)
