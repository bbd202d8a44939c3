"""Loss scales and finiteness: `tfdls.loss_scale` (FixedLossScale, DynamicLossScale), the exact
division by a scale (`tfdls._division`), and `tfdls.finite` (all_finite, the sum guard's bound)."""
