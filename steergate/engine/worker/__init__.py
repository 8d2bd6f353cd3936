"""Worker side of the steering engine.

* :mod:`engine.worker.library`     registers the custom ops with the dispatcher (pure torch);
* :mod:`engine.worker.op`          the ``steergate::steer`` custom op (pure torch);
* :mod:`engine.worker.clamp`       the clamp and add-then-clamp ops and clamp tables (pure torch);
* :mod:`engine.worker.tables`      per-site tables, slot allocation, index fill (pure torch);
* :mod:`engine.worker.conventions` per-architecture layer conventions and the support table;
* :mod:`engine.worker.layers`      wraps decoder layers to call the op (pure torch);
* :mod:`engine.worker.runner`      the vLLM adapter (patches the V1 model runner);
* :mod:`engine.worker.compile_tag` keeps vLLM's compile cache from reusing unsteered graphs.

See docs/steering-op.md.
"""
