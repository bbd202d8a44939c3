"""tf.distribute (`tfdls._distribute`): MirroredStrategy over two logical CPUs and a real
two-worker MultiWorkerMirroredStrategy cluster."""
