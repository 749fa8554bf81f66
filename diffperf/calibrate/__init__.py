"""Fitting the efficiency factors: parameterisation, dataset and loss, the fit, cross-validation,
the Laplace uncertainty, model errors measured on held-out rows, prediction intervals and batch
prediction of a CSV."""

from ._batch_predict import predict_csv as predict_csv
from ._cv import cross_validate as cross_validate
from ._error_model import (
    Descriptor as Descriptor,
    ErrorModel as ErrorModel,
    descriptor as descriptor,
    spec_descriptor as spec_descriptor,
)
from ._fit import calibrate as calibrate
from ._held_out import measure_held_out as measure_held_out
from ._parameterisation import Parameterisation as Parameterisation
from ._results import Fit as Fit
from ._uncertainty import (
    FitUncertainty as FitUncertainty,
    PredictionInterval as PredictionInterval,
    error_model_intervals as error_model_intervals,
    load_uncertainty as load_uncertainty,
    prediction_interval as prediction_interval,
)
