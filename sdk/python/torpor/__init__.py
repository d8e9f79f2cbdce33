"""torpor: helpers for code running inside a torpor sandbox.

``import torpor.resume`` subscribes the process to the sandbox's resume events
(reseeding ``random`` first on every resume); see ``torpor.resume``.
"""

__version__ = "0.1.0"
