"""``foxhunt-jax bench``: speed of every phase on whatever device JAX runs on, in one run.

Sections (``--sections``, all by default, run in this order), one module each, over the
backends (``xla``, ``pallas``) and precisions (``float32``, ``bfloat16``) side by side
(``--variants``):

- ``seed`` (:mod:`.seed`): the seed workload's epoch through the public Trainer API, per phase,
  and each variant's compile in this process;
- ``compile`` (:mod:`.compilation`): the whole epoch's compile per variant in fresh processes,
  cold and from the caches it filled;
- ``device`` (:mod:`.device`): GEMM rates, copy bandwidth, the cost of a ``lax.scan`` iteration;
- ``forward`` (:mod:`.forward`): the Q-forward and the other fused forwards alone, XLA against
  the Pallas kernels, with their equality on fresh inputs;
- ``collect`` (:mod:`.collect`): collection throughput in env-steps/s by episode count;
- ``train`` (:mod:`.train`): learner steps/s at the seed batch and samples/s at a big batch;
- ``replay`` (:mod:`.replay`): add/sample/update beside flashbax;
- ``cmdbuf`` (:mod:`.cmdbuf`, GPU only): what the library's while-loop command buffers buy;
- ``population`` (:mod:`.population`): the seed workload as populations of P agents in one
  program: epoch time, agent-epochs/s and memory a member.

:mod:`.runner` runs them and writes the JSON after every section (``--json``); :mod:`.report`
holds the tables, the roofline and ``--merge`` (:func:`foxhunt_jax.bench.report.merge`), which
joins the JSONs of runs that split the sections between them. ``--quick`` runs every section at
tiny sizes, a check of every code path on a CPU (the compile section's processes then start
from the caller's cache folder, not an empty one).

The options are in :mod:`.options`, which imports nothing heavy, so that this package's import
does not load JAX.
"""

from foxhunt_jax.bench.options import SECTIONS, add_arguments

__all__ = ["SECTIONS", "add_arguments"]
