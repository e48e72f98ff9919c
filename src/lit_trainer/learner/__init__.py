"""The learner: transitions packed into micro-batches (``batching``), the model and its optimizer step
(``policy``), and checkpoints that a run resumes from (``checkpoint``)."""
