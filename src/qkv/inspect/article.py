"""The article's own sentence: only "river" tells which "bank" is meant. The demo walks
through it, and the server's page and API offer it first."""

SENTENCE = "The bank on the side of the river"
