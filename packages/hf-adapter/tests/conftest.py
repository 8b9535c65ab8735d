import sys
from pathlib import Path

# hf_helpers is imported by the tests and, by module name, inside the gloo pool workers.
sys.path.insert(0, str(Path(__file__).parent))
