"""Compatibility: the versions and private names tfdls needs (`tfdls._compat`), Keras 3 code
written for keras.optimizers.LossScaleOptimizer, Keras' own tests, TF 2.4-style TF1 graphs."""
