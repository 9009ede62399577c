"""Stand-ins for sgl-kernel's CPU ops, registered as ``torch.ops.sgl_kernel.<name>`` (see README.md).

Importing this package registers the ops below with the same namespace, names and schemas as the
compiled library (``sgl-kernel/csrc/cpu/torch_extension_cpu.cpp`` at github:mingfeima/sglang
2f14d6c). They are exactly the ops SGLang 0.5.23's CPU engine uses for a Qwen3.5 model on the
non-AMX path: the nine it calls, plus ``fused_qk_gemma_rmsnorm_cpu``, which ``sglang.srt.models.qwen3_5``
looks up when it is imported. ``convert_weight_packed`` is deliberately absent: SGLang takes the
AMX path (many more ops) only where that op exists.

Set ``OPENJEV_STANDIN_CALL_LOG=/path/file`` to have each process append ``<pid> <op>`` there on the
first call of each op, so a test can show which stand-ins an engine ran.
"""

from __future__ import annotations

from openjev_testsupport import op_library

from . import ops

NAMESPACE = "sgl_kernel"

SCHEMAS = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate, bool inplace) -> Tensor(a!)",
    "fused_rmsnorm_gated_cpu": "fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
    "fused_qk_gemma_rmsnorm_cpu":
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
        " -> (Tensor, Tensor)",
    "fused_qk_gemma_rmsnorm_with_gate_cpu":
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps,"
        " int head_dim, int num_head) -> (Tensor, Tensor, Tensor)",
    "chunk_gated_delta_rule_cpu":
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta,"
        " Tensor initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first,"
        " bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-6) -> (Tensor, Tensor)",
    "causal_conv1d_fwd_cpu":
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_states, Tensor? query_start_loc,"
        "Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, int pad_slot_id, bool is_vnni) ->"
        " Tensor",
    "causal_conv1d_update_cpu":
        "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, bool silu_activation,"
        "Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, bool is_vnni) -> Tensor",
    "fused_sigmoid_gating_delta_rule_update_cpu":
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor "
        "a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, bool "
        "use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
    "fused_gdn_gating_cpu": "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu":
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int "
        "num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)",
}

_LIB = None


def register() -> None:
    """Define and implement the ops under torch.ops.sgl_kernel (once per process); refuses, naming the
    ops, when the namespace already holds one of them (the compiled library is loaded)."""
    global _LIB
    if _LIB is None:
        _LIB = op_library.define_ops(NAMESPACE, SCHEMAS, ops, ("CPU",), "sgl_kernel_cpu_standin")


register()
