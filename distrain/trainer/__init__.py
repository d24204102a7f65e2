"""One rank's run: building its components (``build``), the train loop (``loop``), what ranks agree on at every
step boundary (``agreement``), graceful stops (``preemption``), seeding and fault injection for tests; ``rank`` ties
them together (``build_and_train``)."""
