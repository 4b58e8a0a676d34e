"""The paper's Tbl. 4: five community pruning projects rebuilt as amanda tools.

One module per project, each written from the published algorithm:

* :mod:`.tile_wise` — tile-wise sparsity (Guo et al., SC'20), static, portable
  (TensorFlow graphs and PyTorch);
* :mod:`.feature_boosting` — dynamic channel pruning by feature boosting and
  suppression (Gao et al., ICLR'19), PyTorch;
* :mod:`.activation` — dynamic activation pruning (per-sample top-k of the
  ReLU outputs, forward and backward), PyTorch;
* :mod:`.block_skim` — attention pruning in the style of Block-Skim (Guan et
  al., HPCA'22), PyTorch transformers;
* :mod:`.vector_wise` — vector-wise 2:4 pruning as APEX's ASP does it, portable.

The small workloads (VGG-, SqueezeNet- and ResNet-style CNNs; tiny
random-init BERT-family configs) are the model zoo :mod:`amanda.pruning_models`,
re-exported as :mod:`.models`; the PyTorch-only projects' torch code is in
``amanda/runtime/pytorch/pruning_*.py``. The baselines written the way the
original projects are written live in ``benchmarks/pruning_baselines/``. See
``docs/tools/pruning-projects.md``. Importing this package imports no framework.
"""
