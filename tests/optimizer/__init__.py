"""`tfdls.LossScaleOptimizer` (`tfdls.optimizer`) and the step machinery it runs: the step plan
(`_plan`), the masked skip (`_masked_update`), the unscaling rule (`_unscaling`), the recorded
values (`_record`), the sum guard in a step, and training with it end to end."""
