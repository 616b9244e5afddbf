"""The model side: loaded once, one way (torch from here on, imported when a function runs).

``dtypes``         the one dtype table (no torch until it runs)
``load``           the one loader of a causal LM (:class:`~onepass.model.load.ModelSpec`) and of a model's config
``config``         the decoder's part of a (multimodal) model config, read the same way everywhere
``layers``         a model's decoder layers, named: the stack, each layer's type and token mixer
``tiny``           tiny random HF models from configs, every architecture we test (offline)
``couplings``      every reliance on transformers/peft/accelerate/torch/trl internals, with how it fails
``private_names``  every private name of another library onepass uses: found before use, or one line
``precision``      float64 norms (and routers) for verification
``float64``        the recurrent kernels' float32 casts made float64 (verification)
"""
