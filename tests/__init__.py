"""tfdls' tests: a package, so that pytest imports every test module and helper by
its dotted name (``tests.support.fast_loop``, ...), one name per file."""
