"""Scale boundaries (`tfdls.boundaries`, `_boundary_scales`, `_factor_readings`): the layers,
their factors, their readings and `UnscaledInput`."""
