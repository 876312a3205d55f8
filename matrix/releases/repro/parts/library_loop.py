"""A loop its library runs in one go (the Trainer's train(), Lightning's fit()), handed to the
phases step by step, as the matrix's LibraryLoop does: the run's losses and applied steps are
recorded as the library takes them, k handed to train_steps, then one to the resumed step; a
library error is kept and raised where the phases ask for what it prevented. Not imported: an
engine part built on ReplayedLoop gets this text before its own (matrix/releases/repro/generate.py)."""


class ReplayedLoop:
    """The steps of a library's one-shot loop, handed out in the phases' order. A subclass says how
    many steps its library runs in all (`total`) and runs it in ran(run)."""

    total = None

    @staticmethod
    def fail(progress, missing):
        if progress["error"] is not None:
            raise progress["error"]
        raise CheckFailed("CheckFailure", missing)

    @staticmethod
    def paused(progress):
        return progress["held"] is not None and progress["handed"] == (0 if progress["resumed"] else STEPS)

    def train(self, run, steps, seeds=None):
        progress = run["progress"]
        if seeds is not None:
            progress["seeds"] = seeds
        progress = self.ran(run)
        start, end = progress["handed"], progress["handed"] + steps
        if len(progress["losses"]) < end:
            ran = len(progress["losses"]) - start
            self.fail(progress, f"the library's loop ran {ran} of the {steps} steps asked for")
        if progress["resumed"]:
            end = len(progress["losses"])  # all it ran: one step, unless it restarted
        progress["handed"] = end
        if progress["error"] is not None and (progress["resumed"] or end >= self.total):
            raise progress["error"]  # after its last step: the library failed as its loop ended
        counts = [progress["applied_after"][start - 1] if start else progress["applied_before"]]
        counts += progress["applied_after"][start:end]
        return [(progress["losses"][start + i], counts[i + 1] != counts[i]) for i in range(end - start)]

    def held_evaluation(self, run):
        """The evaluation the library took where the phases are (after step k, or after the resumed
        step), its loop run first; a library that ran none fails as the matrix's LibraryLoop does."""
        progress = self.ran(run)
        evaluation = None
        if self.paused(progress):
            evaluation = progress["held"]["evaluation"] if progress["resumed"] else progress["evaluation"]
        if evaluation is None:
            self.fail(progress, "the library ran no evaluation on its schedule")
        return evaluation
