"""The public API as a whole: every invalid argument or input and its error
(the "Bad input" table, docs/bad-input.md)."""
