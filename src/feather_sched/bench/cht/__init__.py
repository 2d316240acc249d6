"""``feather cht-bench``: the Chunked Hash Tree's cost per decision against a token radix
tree and SGLang's own ``SchedulePolicy``."""
