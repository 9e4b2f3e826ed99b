"""A double of PyTorch's own cuDNN attention gate, ``sdp_utils.cpp`` (aten/src/ATen/native/transformers/
cuda), transcribed filter by filter from its main branch (read 2026-12), never from ``striped_sp``:

* ``check_cudnn_hardware_support``: sm80 to sm121;
* ``can_use_cudnn_attention``: built with cuDNN >= 9 (``CUDNN_VERSION < 90000`` refuses);
* ``check_cudnn_tensor_shapes``: runtime cuDNN >= 8.9.3; ``head_dim_limit`` 128, 256 when
  ``is_sm90_or_sm10x && !is_unsupported_sm107 && cudnn_version > 92200 && kCuDNNFrontendSupportsD256``
  (frontend >= 1.24), else 192 when ``is_sm90_or_sm10x && cudnn_version >= 91100 && d_qk == 192 && d_v == 128``;
  ``d_qk``, ``d_v`` multiples of 8; ``s_k != 1``;
* ``check_cudnn_d256_bprop_head_dim`` (inputs requiring grad): where d256 is supported, only
  ``<= 128``, ``(192, 128)`` or ``(256, 256)``;
* ``check_prefer_cudnn_attention``: ``cudnn_version > 91500 && (major == 9 || major == 10)``, and
  with ``CUDA_VERSION < 13000`` also ``(!minor || minor == 3)``.

``is_sm90_or_sm10x = (major == 9 && !minor) || major == 10``; ``is_unsupported_sm107 = major == 10 &&
minor == 7 && cudnn_version <= 92500``.
"""

from __future__ import annotations


def can_use_cudnn(major, minor, cudnn, frontend_d256, d_qk, d_v, s_k=2, requires_grad=True) -> bool:
    if cudnn is None:
        return False  # torch not compiled with cuDNN (AT_CUDNN_ENABLED)
    if not (major > 8 or (major == 8 and minor >= 0)) or not (major < 12 or (major == 12 and minor <= 1)):
        return False
    if cudnn < 90000:  # CUDNN_VERSION < 90000 (the runtime stands in for the compiled one here)
        return False
    if cudnn < 8903:
        return False
    head_dim_limit = 128
    is_sm90_or_sm10x = (major == 9 and not minor) or major == 10
    is_unsupported_sm107 = major == 10 and minor == 7 and cudnn <= 92500
    if is_sm90_or_sm10x and not is_unsupported_sm107 and cudnn > 92200 and frontend_d256:
        head_dim_limit = 256
    elif is_sm90_or_sm10x and cudnn >= 91100 and d_qk == 192 and d_v == 128:
        head_dim_limit = 192
    if not (d_qk <= head_dim_limit and d_v <= head_dim_limit):
        return False
    if not (d_qk % 8 == 0 and d_v % 8 == 0):
        return False
    if s_k == 1:
        return False
    if requires_grad:
        supports_d256 = cudnn > 92200 and frontend_d256 and is_sm90_or_sm10x and not is_unsupported_sm107
        if supports_d256 and not ((d_qk <= 128 and d_v <= 128) or (d_qk == 192 and d_v == 128)
                                  or (d_qk == 256 and d_v == 256)):
            return False
    return True


def prefers_cudnn(major, minor, cudnn, cuda_version: str) -> bool:
    if cudnn is None:
        return False
    if int(cuda_version.split(".")[0]) < 13:
        return cudnn > 91500 and (major == 9 or major == 10) and (not minor or minor == 3)
    return cudnn > 91500 and (major == 9 or major == 10)
