"""The five pruning projects written the way the originals are written
(TensorFlow session hooks, edits to a model's source, module/optimizer hooks),
each for one model: the baselines the amanda tools in
``amanda/tools/pruning_projects/`` are checked and counted against."""
