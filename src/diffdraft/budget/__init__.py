"""How big a draft tree to verify: what verification costs on this machine (:mod:`.cost`,
:mod:`.batch_cost`), the budget that pays for one sequence (:mod:`.planner`) and for a batch's
round (:mod:`.round_budget`), and the tree rule that asks them (:mod:`.auto_budget`)."""
