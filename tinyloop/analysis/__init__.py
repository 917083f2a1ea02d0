"""Analysis on top of the runtime: loop gain, model inspection, held-out evaluation."""
