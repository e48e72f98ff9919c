"""Where the model comes from: folders and names resolved (``folders``), the embedded default converted once
(``embedded``)."""
