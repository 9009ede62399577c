"""The module sgl_kernel falls back to (``import common_ops``) when no compiled library loads.

Put this directory and tests/ on PYTHONPATH on a machine whose sgl_kernel package lacks its
compiled ``common_ops`` library: importing this registers the pure-PyTorch stand-ins
(openjev_testsupport.sgl_kernel_cuda_standin) as torch.ops.sgl_kernel.<name>.
"""

import openjev_testsupport.sgl_kernel_cuda_standin as _standin

_standin.register()

__all__ = sorted(_standin.SCHEMAS)
