"""Tools around the library: `zcompile plan`, memory reports and the local multi-process launcher."""
