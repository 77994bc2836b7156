import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # the suite's support module (oracle) sits beside it
