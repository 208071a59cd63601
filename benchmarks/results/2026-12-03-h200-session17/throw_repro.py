import sys, torch, os
from torch.utils import cpp_extension
src = r'''
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
at::Tensor boom(const at::Tensor& x) { TORCH_CHECK(x.dim() == 7, "boom: wanted 7 dims, got ", x.dim()); return x; }
TORCH_LIBRARY(NS, m) { m.def("boom(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NS, CPU, m) { m.impl("boom", &boom); }
'''
name, flags = sys.argv[1], sys.argv[2:]
p = f"/tmp/diag_{name}.cpp"; open(p, "w").write(src.replace("NS", "diag_" + name))
cpp_extension.load(name="diag_" + name, sources=[p], extra_cflags=flags, extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [], is_python_module=False)
try:
    getattr(torch.ops, "diag_" + name).boom(torch.zeros(2))
except RuntimeError as e:
    print(name, "OK:", str(e).splitlines()[0])
