"""Reading recorded runs: replay a journal into fresh workers or a fresh scheduler, dump one
step's worker inputs, and show, diff or draw journals. (Recording itself is the engine core's:
the journal format lives in `protocol.journal`.)"""
