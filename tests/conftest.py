from tests.servers import *  # noqa: F403 - shared server fixtures
from tests.emulators import *  # noqa: F403 - GCS and Azure emulator fixtures
