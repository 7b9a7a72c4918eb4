"""The canary installed in serving engines that this project did not write (one subpackage per engine)."""
