"""What tfdls reports about a run: gradient statistics (`tfdls.gradient_stats`), overflow
attribution (`tfdls.overflow`), LossScaleMonitor (`tfdls.callbacks`) and the counters."""
