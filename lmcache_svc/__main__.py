import sys

from lmcache_svc.cli import main

sys.exit(main())
