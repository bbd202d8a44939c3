"""The public API as a whole: every invalid argument or input and its error
(README's "Bad input" table)."""
